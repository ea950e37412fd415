"""``python -m cli``: the ``airlock`` command, where its script is not on PATH."""

from .main import main

if __name__ == "__main__":
    main()
