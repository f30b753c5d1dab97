import sys

from trainer.main import cli

sys.exit(cli())
