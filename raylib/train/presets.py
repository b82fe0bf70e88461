"""BERT architecture presets (Turc et al. 2019 compact models, plus the original base/large).

Models are always built from a config: no weights are downloaded.
"""

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "bert-mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "bert-small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "bert-medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(
        num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096
    ),
}
