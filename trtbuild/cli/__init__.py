"""The ``trtbuild`` command: one click group, a module per subcommand.

User errors (``TrtbuildError``) print one ``error:`` line and exit with status 2; nothing else is caught.
SIGTERM is handled like Ctrl-C (SIGINT): cleanup code runs (temporary directories are removed, ``run --input``
writes the results finished so far) and the command exits with status 130.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import click

from ..errors import TrtbuildError
from .bench import bench
from .build import build
from .chat import chat
from .convert import convert
from .eval import eval_command
from .inspect import inspect
from .pipeline import pipeline
from .quantize import quantize
from .run import run
from .serve import serve
from .verify import verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trtbuild")
def cli() -> None:
    """Compile LLM checkpoints into paged-attention engines and run them."""


cli.add_command(convert)
cli.add_command(quantize)
cli.add_command(build)
cli.add_command(eval_command)
cli.add_command(run)
cli.add_command(chat)
cli.add_command(bench)
cli.add_command(serve)
cli.add_command(pipeline)
cli.add_command(inspect)
cli.add_command(verify)


_interrupted: list[int] = []  # the signals received; once one has, any error on the way out is its consequence


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupted.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        cli.main(standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("aborted", err=True)
        sys.exit(130)
    except TrtbuildError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except Exception:
        # The KeyboardInterrupt raised at a signal can surface as another exception when it lands inside an
        # extension's call (safetensors turns it into a ValueError): after a signal, every error means "aborted".
        if _interrupted:
            click.echo("aborted", err=True)
            sys.exit(130)
        raise
