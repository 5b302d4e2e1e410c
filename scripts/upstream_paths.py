"""Puts upstream MaxText's module paths (MaxText/upstream_paths: python -m maxtext.trainers.pre_train.train, ...)
on this interpreter's sys.path with a .pth file in its site-packages; MaxText/upstream_paths/README.md says why
they are not a package of their own. Run by scripts/setup.sh and the Docker image; rewrites nothing unchanged."""

import os
import sysconfig

folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "MaxText", "upstream_paths")
pth = os.path.join(sysconfig.get_paths()["purelib"], "maxtext-upstream-paths.pth")
if not os.path.isfile(pth) or open(pth).read().strip() != folder:
    with open(pth, "w") as f:
        f.write(folder + "\n")
