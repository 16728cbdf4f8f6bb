"""clipax: gradient clipping for JAX.

Value, per-leaf norm and global-norm clipping, adaptive rules (AutoClip, ZClip,
AdaGC, AGC, block RMS, per-example DP clipping), QK-Clip and spectral clipping,
as Optax transformations and as pure functions on pytrees in `clipax.tree`; norms
accumulated in float32, jit- and sharding-ready, per layer of stacked
(scanned) models, with the pre-clip norm and the clipping statistics in
opt_state.
"""

from importlib.metadata import PackageNotFoundError, version

from clipax import tree as tree
from clipax._adagc import AdaGCState as AdaGCState
from clipax._adagc import adagc as adagc
from clipax._adaptive import AutoClipState as AutoClipState
from clipax._adaptive import ZClipState as ZClipState
from clipax._adaptive import autoclip as autoclip
from clipax._adaptive import zclip as zclip
from clipax._agc import adaptive_grad_clip as adaptive_grad_clip
from clipax._block_rms import clip_by_block_rms as clip_by_block_rms
from clipax._global_norm import ClipByGlobalNormState as ClipByGlobalNormState
from clipax._global_norm import clip_by_global_norm as clip_by_global_norm
from clipax._leaves import LayerAxes as LayerAxes
from clipax._metrics import Metrics as Metrics
from clipax._metrics import metrics as metrics
from clipax._migrate import migrate_state as migrate_state
from clipax._nonfinite import NonFiniteError as NonFiniteError
from clipax._nonfinite import nonfinite_errors as nonfinite_errors
from clipax._norm import ClipByNormState as ClipByNormState
from clipax._norm import clip_by_norm as clip_by_norm
from clipax._qk_clip import QKClipState as QKClipState
from clipax._qk_clip import qk_clip as qk_clip
from clipax._reset import ResetOnSpikeState as ResetOnSpikeState
from clipax._reset import reset_on_spike as reset_on_spike
from clipax._skip import SkipSpikesState as SkipSpikesState
from clipax._skip import skip_spikes as skip_spikes
from clipax._spectral import ClipBySpectralNormState as ClipBySpectralNormState
from clipax._spectral import clip_by_spectral_norm as clip_by_spectral_norm
from clipax._stable_spam import StableSpamState as StableSpamState
from clipax._stable_spam import stable_spam as stable_spam
from clipax._stacked import stacked_prefix as stacked_prefix
from clipax._value import clip as clip
from clipax._value import clip_by_value as clip_by_value

try:
    __version__ = version("clipax")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "AdaGCState",
    "AutoClipState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipBySpectralNormState",
    "LayerAxes",
    "Metrics",
    "NonFiniteError",
    "QKClipState",
    "ResetOnSpikeState",
    "SkipSpikesState",
    "StableSpamState",
    "ZClipState",
    "__version__",
    "adagc",
    "adaptive_grad_clip",
    "autoclip",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_spectral_norm",
    "clip_by_value",
    "metrics",
    "migrate_state",
    "nonfinite_errors",
    "qk_clip",
    "reset_on_spike",
    "skip_spikes",
    "stable_spam",
    "stacked_prefix",
    "tree",
    "zclip",
]
