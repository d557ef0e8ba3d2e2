"""Drop-in expert-parallel MoE layer on top of :mod:`mxcomm.ep` (dispatch/combine) and :mod:`mxcomm.gemm`.

* :class:`MoE` / :class:`MoEConfig` / :class:`RouterConfig`: router (softmax or sigmoid top-k, optional
  load-balancing loss), SwiGLU experts sharded over an EP group, optional shared expert,
  ``precision="bf16" | "mxfp8"``. See :mod:`mxcomm.nn.moe` and ``mxcomm/nn/README.md`` (the change that swaps it
  into a torchtitan / Megatron-style MoE block).
* :class:`Router`, :func:`load_balancing_loss`, :func:`grouped_swiglu`, :func:`swiglu_mx`: the pieces.
* :func:`make_ep_group`, :func:`init_single_process`, :func:`attach_optimizer`, :func:`moe_aux_loss`: helpers.
* :func:`moe_reference`: single-process plain-torch oracle from the global weights.
"""
from .config import MoEConfig, RouterConfig
from .experts import ExpertOptions, grouped_swiglu, swiglu_bf16, swiglu_mx
from .moe import MoE, attach_optimizer, init_single_process, make_ep_group, moe_aux_loss
from .reference import ReferenceOutput, moe_reference, reference_route
from .router import Router, RouterOutput, load_balancing_loss

__all__ = [
    "MoE", "MoEConfig", "RouterConfig", "Router", "RouterOutput", "load_balancing_loss", "grouped_swiglu",
    "swiglu_mx", "swiglu_bf16", "ExpertOptions", "make_ep_group", "init_single_process", "attach_optimizer",
    "moe_aux_loss", "moe_reference", "reference_route", "ReferenceOutput",
]
