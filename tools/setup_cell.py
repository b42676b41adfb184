# Setup, identical in every chapter: find the book's `lib` package (on Colab: clone
# the repository first), then pick the device, seed every generator, set the style.
import os, subprocess, sys
REPO_URL = "https://github.com/gpt-from-the-ground-up/gpt-from-the-ground-up"
CLONE = "gpt-from-the-ground-up"
if "google.colab" in sys.modules and not os.path.isdir(CLONE):
    subprocess.run(["git", "clone", "--depth=1", REPO_URL, CLONE], check=True)
# The book's root holds both marker files; a bare `lib` folder (Linux's /lib) does not.
MARKERS = ("lib/setup.py", "tools/setup_cell.py")
ROOT = next((p for p in (CLONE, "..", ".")
             if all(os.path.isfile(os.path.join(p, m)) for m in MARKERS)), None)
if ROOT is None:
    raise FileNotFoundError(f"Open this notebook in the chapters/ folder of {REPO_URL}")
sys.path.insert(0, os.path.abspath(ROOT))
from lib.setup import glue, setup, show_source
env = setup(seed=0)
