from qgtrain.interface.cli import main

raise SystemExit(main())
