from microscale.cli import main

raise SystemExit(main())
