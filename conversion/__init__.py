"""kimi3_conversion: the checkpoint conversion commands and what they share.

Commands (each also a console script, and runnable as `python conversion/<module>.py` from a checkout):
    convert_k3_to_hf     kimi3-convert-k3           official K3 folder -> a folder ready to publish
    quantize_mxfp4       kimi3-quantize-mxfp4       float routed experts -> MXFP4, as K3 is released
    convert_kimi_linear  kimi3-convert-kimi-linear  a Kimi Linear checkpoint -> this package's layout
    make_tiny_checkpoint                            rebuilds the bundled tiny K3 checkpoint

Every conversion is a plan computed and checked before anything is written (`plan`, `config_check`, one
`*_job` module per command), executed shard by shard (`runner`, `tensor_io`) into a resumable partial folder
(`resume`) and verified against the source (`verify`). Command modules import only `cli` at load time, so that
`--help` does not load torch.
"""
