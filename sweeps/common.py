"""What every sweep module shares: the repository root."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
