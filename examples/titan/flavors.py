"""A Llama 3 flavor for the overhead measurement, registered the way torchtitan takes
a user's own model shapes (``--experimental.custom_import examples.titan.flavors``,
then ``--model.flavor 1B``): Llama 3.2 1B's shape (16 layers, width 2,048, 32 heads,
8 KV heads, FFN 8,192, vocabulary 128,256), its output head untied as torchtitan builds
Llama 3: 1.50 B parameters."""

from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

llama3_args.setdefault(
    "1B",
    TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    ),
)
