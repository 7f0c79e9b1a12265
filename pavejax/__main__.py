from pavejax.cli import main

raise SystemExit(main())
