"""The shared dock over HTTP: a Starlette service and its read-only pages."""
