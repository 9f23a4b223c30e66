"""The emulated GPU's settings: from the model dir's config.json (key
CONFIG_KEY, which vLLM keeps as an attribute of the model's HF config) and
the environment (ENV_PROFILE, ENV_STEP_MS override the file). Pure: neither
vLLM nor torch.

The latency profile is read with gmock_engine's own reader
(gmock_engine/timing/profile.py): the same file, the same parse, the same
prediction as the mock. gmock_engine is imported from the path when it is
installed or on PYTHONPATH, else loaded from the checkout this plugin sits
in (benchmarks/emulated_gpu/ of it): the plugin runs in vLLM's venv, where
gmock_engine is usually not installed; that module imports only the
standard library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .pacing import Batch, StepFunctionError, expression_step, profile_step

#: config.json's key holding the settings (a JSON object).
CONFIG_KEY = "gmock_emulated_gpu"
#: Environment variables that override config.json: a profile's path, or a step expression.
ENV_PROFILE = "GMOCK_EMULATED_GPU_PROFILE"
ENV_STEP_MS = "GMOCK_EMULATED_GPU_STEP_MS"
#: The checkout this plugin is part of (benchmarks/emulated_gpu/gmock_emulated_gpu/config.py).
CHECKOUT = Path(__file__).resolve().parents[3]


def latency_profile_module() -> Any:
    """gmock_engine.timing.profile: imported, or loaded from CHECKOUT."""
    try:
        from gmock_engine.timing import profile as latency_profile  # type: ignore[import-not-found]

        return latency_profile
    except ImportError:
        pass
    path = CHECKOUT / "gmock_engine" / "timing" / "profile.py"
    name = "gmock_emulated_gpu._latency_profile"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.exists():
        raise StepFunctionError(f"gmock_engine's timing/profile.py not found (looked for {path}; "
                                "put the gmock_engine checkout on PYTHONPATH)")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Settings:
    """One emulated GPU: a step function (a profile's path, or an expression)
    and whether a profile's steps draw from its spread, with which seed."""

    latency_profile: Optional[str] = None
    step_ms: Optional[str] = None
    spread: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if bool(self.latency_profile) == bool(self.step_ms):
            raise StepFunctionError(f"{CONFIG_KEY}: give latency_profile or step_ms (one of them), got {self}")

    def step_function(self) -> Callable[[Batch], float]:
        """Batch -> ms; StepFunctionError (or the profile reader's ProfileError, OSError) naming the problem."""
        if self.step_ms:
            return expression_step(self.step_ms)
        profile = latency_profile_module().read_profile(self.latency_profile)
        return profile_step(profile, self.spread, self.seed)

    def describe(self) -> str:
        """One line for the engine's log."""
        if self.step_ms:
            return f"step_ms = {self.step_ms}"
        return f"latency profile {self.latency_profile}" + (f", its spread (seed {self.seed})" if self.spread else "")


def from_mapping(values: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> Settings:
    """Settings from config.json's CONFIG_KEY object, then the environment's overrides."""
    env = os.environ if env is None else env
    unknown = sorted(set(values) - {"latency_profile", "step_ms", "spread", "seed"})
    if unknown:
        raise StepFunctionError(f"{CONFIG_KEY}: unknown key(s) {', '.join(unknown)}")
    profile, step_ms = values.get("latency_profile"), values.get("step_ms")
    if env.get(ENV_PROFILE):
        profile, step_ms = env[ENV_PROFILE], None
    if env.get(ENV_STEP_MS):
        profile, step_ms = None, env[ENV_STEP_MS]
    return Settings(profile, step_ms, bool(values.get("spread", False)), int(values.get("seed", 0)))


def from_hf_config(hf_config: Any) -> Settings:
    """Settings of the model whose HF config (vLLM's model_config.hf_config) is `hf_config`."""
    values = getattr(hf_config, CONFIG_KEY, None)
    if values is None and not (os.environ.get(ENV_PROFILE) or os.environ.get(ENV_STEP_MS)):
        raise StepFunctionError(f"config.json has no {CONFIG_KEY} and neither {ENV_PROFILE} nor {ENV_STEP_MS} is set")
    return from_mapping(values or {})
