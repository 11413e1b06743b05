from idletrain.cli import main

raise SystemExit(main())
