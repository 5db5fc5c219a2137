"""Layers the stages share: dtype-safe basics (`layers`: LayerNorm and softmax in fp32, the causal conv of the flow
and the vocoder), the Conformer encoders with their KV cache (`conformer`), and precision helpers (`precision`:
per-module dtypes, INT8, CPU packing)."""
