"""Flow stage: speech tokens -> mel spectrogram, by conditional flow matching.

Takes a `masked_diff.FlowRequest` (speech tokens [N] int64, the prompt's tokens and mel [Tp, 80] float32, a speaker
embedding [192]); gives mel frames [80, F] in the flow's dtype. Versions: `masked_diff` (v1 `MaskedDiffWithXvec`:
Conformer encoder + U-Net estimator, and the request/conditioning types every flow takes), `causal` (CosyVoice2
`CausalMaskedDiffWithXvec`: chunk-causal, 2 frames per token), `dit` (CosyVoice3 `CausalMaskedDiffWithDiT`);
`estimator` holds the U-Net blocks v1 and v2 share.
"""
