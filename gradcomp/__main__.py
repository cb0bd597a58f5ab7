"""``python -m gradcomp``: see :mod:`gradcomp.cli`."""

from gradcomp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
