from lorafast.cli import main

raise SystemExit(main())
