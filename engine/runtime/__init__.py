"""Runtime: the stages put to work for requests.

`pipeline` (the encoder stage: request -> `segment.EncodedSegment`s; the decoder stage: segments -> audio; and the
in-process `CosyVoice`), `streaming` (chunked audio while tokens are generated), `scheduler` (the decoder loop that
batches many requests by playback deadline, `playback`), `memory` (what a decoder replica can hold).
"""
