"""The model families neox_hf trains: transformers' classes plus GPT-NeoX's initialisation, nothing forked.

`spec` is the registry (what the parallel code, the builders and interop need to know of a family); each family's
module registers itself when imported here: `modeling` (GPTNeoX, Pythia, GPT-NeoX-20B), `llama` (Llama, Mistral),
`mixtral` (Mixtral) and `neox_moe` (GPT-NeoX's dropless MoE; `moe` is what the MoE families share).
Also here: `init` (GPT-NeoX's initialisation), `vocab` (GPT-NeoX's vocabulary-padding rule), `folder` (saving an HF
folder stock transformers loads).
"""

from neox_hf.model.init import init_std
from neox_hf.model.modeling import NeoXConfig, NeoXForCausalLM, NeoXModel
import neox_hf.model.llama  # noqa: F401,E402  (each family registers itself into neox_hf.model.spec on import)
import neox_hf.model.mixtral  # noqa: F401,E402
import neox_hf.model.neox_moe  # noqa: F401,E402
from neox_hf.model.spec import config_from_recipe

__all__ = ["NeoXConfig", "NeoXForCausalLM", "NeoXModel", "config_from_recipe", "init_std"]
