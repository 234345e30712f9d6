"""Entry point of ``python -m ep_runtime.launch``: one line naming the extra when the launcher's
own packages are missing (the layer itself needs only torch)."""

import sys

EXIT_USAGE = 2
MISSING_RICH = (
    "error: python -m ep_runtime.launch needs rich (the 'launch' extra, with ray): "
    "pip install 'ep_runtime[launch]'"
)


def run() -> int:
    try:
        import rich  # noqa: F401
    except ImportError:
        print(MISSING_RICH, file=sys.stderr)
        return EXIT_USAGE
    from ep_runtime.launch.cli import main

    return main()


sys.exit(run())
