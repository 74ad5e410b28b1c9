"""The registry's name tables, as data: the Python names that are not an op's own
(operator dunders, synonyms, prefixed sub-namespaces), the ``nn.Module`` classes
accepted as list entries, and other frameworks' op names. :mod:`ampkit.policies.registry` reads
them to build its index of entry points and to resolve list entries.

Example:
    >>> import torch
    >>> from ampkit.policies.op_names import DUNDERS, FRAMEWORK_ALIASES, MODULE_OPS
    >>> DUNDERS["__rmatmul__"], MODULE_OPS[torch.nn.Linear], FRAMEWORK_ALIASES["paddle"]["concat"]
    ('matmul', 'linear', ('cat',))
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch.nn as nn

__all__ = ["DUNDERS", "FRAMEWORK_ALIASES", "MODULE_OPS", "PREFIXED", "SYNONYMS"]


#: Operator dunders whose Python-level function differs from the Tensor method they
#: lower to. (``a + b`` already reaches __torch_function__ as ``Tensor.add``.)
DUNDERS: Mapping[str, str] = {
    "__add__": "add", "__radd__": "add",
    "__sub__": "sub", "__rsub__": "sub",
    "__mul__": "mul", "__rmul__": "mul",
    "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__truediv__": "div", "__rtruediv__": "div", "__div__": "div", "__rdiv__": "div",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__mod__": "remainder", "__rmod__": "remainder",
    "__pow__": "pow", "__rpow__": "pow",
    "__neg__": "neg", "__abs__": "abs",
}

#: Different Python names of one aten op; listing either covers both.
SYNONYMS: Mapping[str, str] = {
    "concat": "cat", "concatenate": "cat",
    "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub",
    "clip": "clamp", "absolute": "abs", "negative": "neg", "ger": "outer",
    "arccos": "acos", "arcsin": "asin", "arctan": "atan", "arctan2": "atan2",
    "arccosh": "acosh", "arcsinh": "asinh", "arctanh": "atanh",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
    "not_equal": "ne", "fix": "trunc", "special_expit": "sigmoid", "special_exp2": "exp2",
    "special_expm1": "expm1", "special_log1p": "log1p", "special_round": "round",
    "special_log_softmax": "log_softmax", "special_softmax": "softmax",
}

#: Prefixed sub-namespaces, named the way native autocast's lists name them.
PREFIXED: tuple[tuple[str, str], ...] = (("linalg", "linalg_"), ("fft", "fft_"),
                                          ("special", "special_"))

#: nn.Module classes accepted as list entries, mapped to the op their forward runs.
MODULE_OPS: Mapping[type, str] = MappingProxyType({
    nn.Linear: "linear", nn.Bilinear: "bilinear",
    nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
    nn.BatchNorm1d: "batch_norm", nn.BatchNorm2d: "batch_norm", nn.BatchNorm3d: "batch_norm",
    nn.LayerNorm: "layer_norm", nn.GroupNorm: "group_norm",
    nn.InstanceNorm1d: "instance_norm", nn.InstanceNorm2d: "instance_norm",
    nn.InstanceNorm3d: "instance_norm",
    nn.Embedding: "embedding", nn.EmbeddingBag: "embedding_bag",
    nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax",
    nn.ReLU: "relu", nn.GELU: "gelu", nn.PReLU: "prelu", nn.SiLU: "silu",
    nn.CrossEntropyLoss: "cross_entropy", nn.NLLLoss: "nll_loss", nn.MSELoss: "mse_loss",
    nn.LSTM: "lstm", nn.GRU: "gru", nn.LSTMCell: "lstm_cell", nn.GRUCell: "gru_cell",
    nn.RNNCell: "rnn_tanh_cell",
})

#: Other frameworks' op names, translated to canonical names. One alias may stand
#: for several torch ops (MXNet's ``Convolution`` covers conv1d/2d/3d).
FRAMEWORK_ALIASES: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "paddle": MappingProxyType({
        "elementwise_add": ("add",), "elementwise_sub": ("sub",),
        "elementwise_mul": ("mul",), "elementwise_div": ("div",),
        "elementwise_pow": ("pow",), "elementwise_max": ("maximum",),
        "elementwise_min": ("minimum",), "elementwise_mod": ("remainder",),
        # Matrix products only: Paddle's dygraph nn.Linear / F.linear run Paddle's own
        # ``linear`` op (torch's ``linear``), which is on none of Paddle's AMP lists.
        "matmul_v2": ("matmul", "mm", "bmm", "addmm", "baddbmm"),
        # Paddle's legacy ``mul`` op is the fully-connected matrix product.
        "mul": ("mm", "addmm"),
        "fc": ("linear",), "depthwise_conv2d": ("conv2d",),
        "conv2d_transpose": ("conv_transpose2d",), "conv3d_transpose": ("conv_transpose3d",),
        "max_pool2d_with_index": ("max_pool2d",), "pool2d": ("avg_pool2d", "max_pool2d"),
        "pool3d": ("avg_pool3d", "max_pool3d"),
        "lookup_table": ("embedding",), "lookup_table_v2": ("embedding",),
        "softmax_with_cross_entropy": ("cross_entropy",), "c_softmax_with_cross_entropy":
            ("cross_entropy",),
        "cross_entropy": ("cross_entropy",), "cross_entropy2": ("cross_entropy",),
        "sigmoid_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
        "reduce_sum": ("sum",), "reduce_mean": ("mean",), "reduce_prod": ("prod",),
        "reduce_max": ("amax",), "reduce_min": ("amin",),
        "squared_l2_norm": ("norm",), "p_norm": ("norm",),
        "bilinear_interp": ("interpolate",), "bilinear_interp_v2": ("interpolate",),
        "nearest_interp": ("interpolate",), "nearest_interp_v2": ("interpolate",),
        "bicubic_interp": ("interpolate",), "bicubic_interp_v2": ("interpolate",),
        "linear_interp": ("interpolate",), "linear_interp_v2": ("interpolate",),
        "trilinear_interp": ("interpolate",), "trilinear_interp_v2": ("interpolate",),
        "scatter": ("scatter",), "scatter_nd_add": ("index_add",),
        "concat": ("cat",), "sync_batch_norm": ("batch_norm",),
        "huber_loss": ("huber_loss",), "bce_loss": ("binary_cross_entropy",),
        "kldiv_loss": ("kl_div",), "mse_loss": ("mse_loss",),
        "fused_attention": ("scaled_dot_product_attention",),
        "flash_attn": ("scaled_dot_product_attention",),
        "sigmoid": ("sigmoid",), "tanh": ("tanh",),
        # names on Paddle's default AMP lists (python/paddle/amp/amp_lists.py)
        "fused_gemm_epilogue": ("addmm",), "tanh_shrink": ("tanhshrink",),
        "pnorm": ("norm",), "frobenius_norm": ("norm",), "cos_sim": ("cosine_similarity",),
        "log_loss": ("binary_cross_entropy",),
    }),
    "mxnet": MappingProxyType({
        "Convolution": ("conv1d", "conv2d", "conv3d"),
        "Deconvolution": ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        "FullyConnected": ("linear",), "Dense": ("linear",),
        "RNN": ("lstm", "gru", "rnn_tanh", "rnn_relu"),
        "dot": ("matmul", "mm"), "batch_dot": ("bmm",),
        "elemwise_add": ("add",), "elemwise_sub": ("sub",), "elemwise_mul": ("mul",),
        "elemwise_div": ("div",), "broadcast_add": ("add",), "broadcast_sub": ("sub",),
        "broadcast_mul": ("mul",), "broadcast_div": ("div",), "broadcast_plus": ("add",),
        "broadcast_minus": ("sub",), "_plus": ("add",), "_minus": ("sub",),
        "_mul": ("mul",), "_div": ("div",), "add_n": ("add",), "ElementWiseSum": ("add",),
        "Concat": ("cat",), "concat": ("cat",), "stack": ("stack",), "where": ("where",),
        "softmax": ("softmax",), "log_softmax": ("log_softmax",),
        "SoftmaxOutput": ("cross_entropy",), "SoftmaxActivation": ("softmax",),
        "LayerNorm": ("layer_norm",), "InstanceNorm": ("instance_norm",),
        "GroupNorm": ("group_norm",), "BatchNorm": ("batch_norm",),
        "L2Normalization": ("normalize",), "norm": ("norm",),
        "exp": ("exp",), "expm1": ("expm1",), "log": ("log",), "log1p": ("log1p",),
        "log2": ("log2",), "log10": ("log10",), "pow": ("pow",), "power": ("pow",),
        "_power": ("pow",), "sum": ("sum",), "mean": ("mean",), "prod": ("prod",),
        "nansum": ("nansum",), "sqrt": ("sqrt",),
        "rsqrt": ("rsqrt",), "square": ("square",), "reciprocal": ("reciprocal",),
        "topk": ("topk",), "Embedding": ("embedding",),
        "Activation": ("relu", "sigmoid", "tanh", "softplus", "softsign"),
        "LeakyReLU": ("leaky_relu", "elu", "selu", "prelu", "gelu"),
        "smooth_l1": ("smooth_l1_loss",), "MakeLoss": (),
        "linalg_gemm": ("addmm",), "linalg_gemm2": ("matmul",),
        "linalg_potrf": ("linalg_cholesky",), "linalg_potri": ("cholesky_inverse",),
        "linalg_trsm": ("linalg_solve_triangular",), "linalg_inverse": ("linalg_inv",),
        "linalg_det": ("linalg_det",), "linalg_slogdet": ("linalg_slogdet",),
        "linalg_syrk": ("matmul",), "linalg_sumlogdiag": ("logdet",),
        "arccos": ("acos",), "arcsin": ("asin",), "cosh": ("cosh",), "sinh": ("sinh",),
        "tan": ("tan",), "arctan": ("atan",), "degrees": ("rad2deg",),
        "radians": ("deg2rad",), "erfinv": ("erfinv",), "gamma": ("lgamma",),
        "gammaln": ("lgamma",), "cumsum": ("cumsum",),
        # names on MXNet's AMP lists (python/mxnet/contrib/amp/lists/symbol_fp16.py)
        "_Plus": ("add",), "_Minus": ("sub",), "_sub": ("sub",),
        "_Mul": ("mul",), "_Div": ("div",), "_mod": ("remainder",), "_Mod": ("remainder",),
        "broadcast_mod": ("remainder",), "_equal": ("eq",), "_Equal": ("eq",),
        "broadcast_equal": ("eq",), "_not_equal": ("ne",), "_Not_Equal": ("ne",),
        "broadcast_not_equal": ("ne",), "_greater": ("gt",), "_Greater": ("gt",),
        "broadcast_greater": ("gt",), "_greater_equal": ("ge",), "_Greater_Equal": ("ge",),
        "broadcast_greater_equal": ("ge",), "_lesser": ("lt",), "_Lesser": ("lt",),
        "broadcast_lesser": ("lt",), "_lesser_equal": ("le",), "_Lesser_Equal": ("le",),
        "broadcast_lesser_equal": ("le",), "_logical_and": ("logical_and",),
        "_Logical_And": ("logical_and",), "broadcast_logical_and": ("logical_and",),
        "_logical_or": ("logical_or",), "_Logical_Or": ("logical_or",),
        "broadcast_logical_or": ("logical_or",), "_logical_xor": ("logical_xor",),
        "_Logical_Xor": ("logical_xor",), "broadcast_logical_xor": ("logical_xor",),
        "_maximum": ("maximum",), "_Maximum": ("maximum",), "broadcast_maximum": ("maximum",),
        "_minimum": ("minimum",), "_Minimum": ("minimum",), "broadcast_minimum": ("minimum",),
        "broadcast_power": ("pow",), "_Power": ("pow",), "_hypot": ("hypot",),
        "_Hypot": ("hypot",), "broadcast_hypot": ("hypot",), "sum_axis": ("sum",),
        "moments": ("var_mean",), "linalg_syevd": ("linalg_eigh",),
        "linalg_makediag": ("diag_embed",), "Softmax": ("cross_entropy",),
        "softmax_cross_entropy": ("cross_entropy",), "LRN": ("local_response_norm",),
        "CTCLoss": ("ctc_loss",), "ctc_loss": ("ctc_loss",), "UpSampling": ("interpolate",),
        "Dropout": ("dropout",),
        # LOSS_OUTPUT_FUNCTIONS: the loss whose gradient each one's backward computes
        "LinearRegressionOutput": ("mse_loss",), "MAERegressionOutput": ("l1_loss",),
        "LogisticRegressionOutput": ("binary_cross_entropy_with_logits",),
    }),
    "mindspore": MappingProxyType({
        "MatMul": ("matmul", "mm", "linear"), "BatchMatMul": ("bmm", "matmul", "baddbmm"),
        "Conv2D": ("conv2d",), "Conv3D": ("conv3d",),
        "Conv2DTranspose": ("conv_transpose2d",), "Conv3DTranspose": ("conv_transpose3d",),
        "PReLU": ("prelu",), "ReLU": ("relu",), "Ger": ("outer",), "Dense": ("linear",),
        "Conv1d": ("conv1d",), "Conv2d": ("conv2d",), "Conv3d": ("conv3d",),
        "Conv1dTranspose": ("conv_transpose1d",), "Conv2dTranspose": ("conv_transpose2d",),
        "Conv3dTranspose": ("conv_transpose3d",), "LayerNorm": ("layer_norm",),
        "BatchNorm1d": ("batch_norm",), "BatchNorm2d": ("batch_norm",),
        "BatchNorm3d": ("batch_norm",), "Softmax": ("softmax",), "LogSoftmax": ("log_softmax",),
        "Add": ("add",), "Mul": ("mul",), "Sub": ("sub",), "Div": ("div",),
        "Exp": ("exp",), "Log": ("log",), "Pow": ("pow",), "ReduceSum": ("sum",),
        "ReduceMean": ("mean",), "Concat": ("cat",), "Stack": ("stack",),
        "LSTMCell": ("lstm_cell",), "GRUCell": ("gru_cell",), "RNNCell": ("rnn_tanh_cell",),
    }),
})
