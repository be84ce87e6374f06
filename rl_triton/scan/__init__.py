"""The one scan engine every op runs on: the Triton kernel (`kernel`), its launch (`launch`),
the tile rule (`tiles`), the Triton stand-in (`jit`) and the torch doubling scan
(`torch_scan`). Nothing here imports the ops or the plan cache."""
