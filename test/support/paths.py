"""The repository's directories, as the tests see them."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / 'config'
TOOLS = ROOT / 'tools'
DOCS = ROOT / 'docs'
FIXTURES = ROOT / 'test' / 'fixtures'
