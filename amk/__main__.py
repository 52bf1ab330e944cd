from amk.cli import main

raise SystemExit(main())
