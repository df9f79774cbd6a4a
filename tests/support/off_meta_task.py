"""Fake tasks at the outer edge: a model that cannot be built on the meta device, and one
whose meta build differs from its real one, and one built on the meta device only.

OffMetaTask's ``build_model`` refuses the meta device, so nothing counts it before its
real build; ``ballast_mib`` makes that build hold that much more memory (touched, so resident) and
``build_s`` makes it take that long: what a task's own code may do at construction.
"""

from __future__ import annotations

import time

import torch
from pydantic import Field
from torch import nn

from tests.support.tiny_task import TinyOptions, TinyTask

SPEC = "tests.support.off_meta_task:OffMetaTask"


class OffMetaOptions(TinyOptions):
    ballast_mib: int = Field(default=0, ge=0)
    build_s: float = Field(default=0.0, ge=0)


class OffMetaTask(TinyTask):
    Options = OffMetaOptions

    def __init__(self, options: OffMetaOptions | None = None) -> None:
        self.off_meta = options if options is not None else OffMetaOptions()
        super().__init__(self.off_meta)

    def build_model(self, seed: int | None = None) -> nn.Module:
        if torch.get_default_device().type == "meta":
            raise RuntimeError("this model is built on a real device only")
        ballast = torch.ones(self.off_meta.ballast_mib * 2**18)  # float32: 4 B each
        time.sleep(self.off_meta.build_s)
        model = super().build_model(seed)
        del ballast  # held until the model is built
        return model


SHIFTING_SPEC = "tests.support.off_meta_task:MetaShiftingTask"


class MetaShiftingTask(TinyTask):
    """A model one unit wider on the meta device than on a real one: the shapes the
    coordinator learns at submission are not those of the θ_0 it builds at the start."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        if torch.get_default_device().type != "meta":
            return super().build_model(seed)
        wider = self.options.model_copy(update={"hidden": self.options.hidden + 1})
        return TinyTask(wider).build_model(seed)


META_ONLY_SPEC = "tests.support.off_meta_task:MetaOnlyTask"


class MetaOnlyTask(TinyTask):
    """A model built on the meta device only: a real build raises, so a coordinator that
    learns the job's tensors without one admits the job, and fails it at its start."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        if torch.get_default_device().type != "meta":
            raise RuntimeError("this model was built for real")
        return super().build_model(seed)
