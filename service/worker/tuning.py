"""One tuning job's set-up: search space, measurer and study attributes.

Shared by ``foldwise tune`` / ``foldwise worker --study`` (service/cli/__init__.py) and the job-queue
worker (service/worker/__init__.py), so that a job tuned through the service searches exactly what
the command line would. Errors are :class:`SetupError` naming the field (``measurer``,
``target``); the CLI prints them as ``--measurer: ...`` and exits 2, the worker fails the job
with the same text.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from service.tuning_request import check_measurer, check_target, measurer_kind

if TYPE_CHECKING:  # for the annotation only: tuner.measure is loaded when a job is set up, not on import
    from tuner import Measurer


class SetupError(ValueError):
    """A bad target or measurer for a tuning job.

    ``field`` is the request field (``measurer``, ``target``); ``flag`` what the command line
    calls it (``--measurer`` or ``--measurer cuda``).
    """

    def __init__(self, message: str, *, field: str, flag: str | None = None):
        self.message, self.field, self.flag = message, field, flag or f"--{field}"
        super().__init__(f"{field}: {message}")

    @property
    def cli_message(self) -> str:
        return f"{self.flag}: {self.message}"


def checked_choice(check: Any, value: Any) -> str:
    """``check(value)`` (:func:`service.tuning_request.check_target` or ``check_measurer``), its
    InvalidRequest as a SetupError naming the same field."""
    from service.errors import InvalidRequest

    try:
        return check(value)
    except InvalidRequest as err:
        raise SetupError(err.message, field=str(err.loc[0])) from None


def quiet_optuna() -> None:
    """Optuna logs every trial on stderr; the CLI and the service report trials themselves."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")


class TuningSetup(NamedTuple):
    """What one tuning job searches with: pass ``gate`` to :class:`tuner.search.tuner.Tuner`."""

    space: Any  # tuner.space.SearchSpace
    measurer: Measurer
    gate: Any  # tuner.compile_gate.CompileGate, or None when compile checks are off
    attrs: dict[str, Any]  # the study's user attrs


def tuning_setup(spec: Any, raw_spec: Any, shape: Mapping[str, int], dtype: Any, target: str, measurer_name: str,
                 *, compile_check: bool = True) -> TuningSetup:
    """The search space, measurer, compile gate and study attrs of one tuning job, from
    unchecked fields (``foldwise tune``): :class:`SetupError` for a bad target or measurer,
    :class:`fuser_core.errors.SpecError` for a bad shape or dtype. The job-queue worker, which
    checked its target and measurer once when it started and derives each job once, calls
    :func:`search_setup` itself."""
    from fuser_core import derive_cascade, make_problem
    from tuner import get_profile

    measurer_name = checked_choice(check_measurer, measurer_name)
    profile = get_profile(checked_choice(check_target, target))
    problem = make_problem(spec, shape, dtype)
    measurer_class = cuda_measurer(profile) if measurer_kind(measurer_name).on_device else None
    return search_setup(problem, derive_cascade(spec), profile, measurer_name, raw_spec,
                        measurer_class=measurer_class, compile_check=compile_check)


def search_setup(problem: Any, derivation: Any, profile: Any, measurer_name: str, raw_spec: Any, *,
                 measurer_class: Any = None, compile_check: bool = True) -> TuningSetup:
    """The set-up of one search from checked parts: the bound ``problem``
    (:func:`fuser_core.make_problem`), the spec's ``derivation``, the target's ``profile``, the
    measurer's name (``cuda`` needs ``measurer_class``, from :func:`cuda_measurer`).

    With ``compile_check`` (the default) every candidate is compiled for the target's arch
    before it is measured or predicted (:mod:`tuner.compile_gate`; no GPU needed), and the
    model measurer predicts from the compiled registers, shared memory and spills."""
    from fuser_core import spec_hash
    from tuner import SearchSpace

    space = SearchSpace(problem, derivation, profile)
    gate = None
    if compile_check:
        from tuner import CompileGate

        gate = CompileGate.for_space(space)
    if not measurer_kind(measurer_name).on_device:  # the cost model predicts
        from tuner import ModelMeasurer

        measurer = ModelMeasurer(problem, derivation, profile, gate=gate)
    else:
        measurer = measurer_class(problem, derivation, profile)
    attrs = {"spec": raw_spec, "spec_hash": spec_hash(problem.spec), "shape": problem.shape, "dtype": problem.dtypes,
             "target": profile.name, "measurer": measurer_name}
    return TuningSetup(space, measurer, gate, attrs)


def cuda_measurer(profile: Any):
    """The cuda measurer's class (the device measurer), after checking there is a GPU and it matches the target."""
    import torch

    flag = "--measurer cuda"
    if not torch.cuda.is_available():
        raise SetupError("no CUDA GPU is visible on this machine (torch.cuda.is_available() is "
                         "false); use --measurer model for predictions from the target's profile",
                         field="measurer", flag=flag)
    try:  # tuner/device/measurer.py; same constructor as ModelMeasurer
        from tuner import DeviceMeasurer
    except ImportError:
        raise SetupError("the cuda measurer is not available in this build; use --measurer model",
                         field="measurer", flag=flag) from None
    from tuner import profile_for_device_name

    name = torch.cuda.get_device_name()
    found = profile_for_device_name(name)
    if found is None:
        raise SetupError(f"no profile matches this GPU ({name})", field="measurer", flag=flag)
    if found != profile.name:
        raise SetupError(f"this GPU ({name}) is not the target {profile.name!r}; pass --target {found}",
                         field="target", flag=flag)
    return DeviceMeasurer


def gpu_name() -> str | None:
    """The visible CUDA GPU's name, or None (no GPU, or torch cannot tell)."""
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001  (a broken driver is "no GPU" when picking a measurer)
        return None


def default_measurer() -> str:
    """``cuda`` when a GPU is visible and this build has the cuda measurer, else ``model``."""
    if gpu_name() is None:
        return "model"
    try:
        from tuner import DeviceMeasurer  # noqa: F401
    except ImportError:
        return "model"
    return "cuda"


def versions() -> dict[str, str | None]:
    """Software versions recorded with workers and bundles."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": version("torch"), "triton": version("triton"),
            "foldwise": version("foldwise")}
