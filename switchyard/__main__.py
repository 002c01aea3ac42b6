import sys
import warnings

from switchyard.cli import main

# torch warns at import when numpy is absent; Switchyard never needs numpy (the base
# install has none), so a new user's first run should not read that as a fault.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
sys.exit(main())
