from qgtrain.cli import main

raise SystemExit(main())
