# Setup, identical in every chapter: find the book's `lib` package (on Colab: clone the
# repository first), then pick the device, seed every generator and set print/figure style.
import os, subprocess, sys
REPO_URL = "https://github.com/gpt-from-the-ground-up/gpt-from-the-ground-up"
if "google.colab" in sys.modules and not os.path.isdir("gpt-from-the-ground-up"):
    subprocess.run(["git", "clone", "--depth=1", REPO_URL], check=True)
ROOT = next(p for p in ("..", ".", "gpt-from-the-ground-up") if os.path.isdir(os.path.join(p, "lib")))
sys.path.insert(0, os.path.abspath(ROOT))
from lib.setup import glue, setup, show_source
env = setup(seed=0)
