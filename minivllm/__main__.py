import sys

from minivllm.cli.main import main

sys.exit(main())
