"""``python -m engine``: the engine process (see :mod:`engine.entrypoints.cli`)."""

from engine.entrypoints.cli import main

if __name__ == "__main__":
    main()
