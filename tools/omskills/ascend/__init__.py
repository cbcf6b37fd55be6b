"""Ascend in one place: this machine's CANN, `atc`, NPUs probed (`probe`), ONNX graphs converted to
OMs under a chosen precision (`atc`, operator table, precision emulated on the CPU), OMs served
through ais_bench (`om_backend`)."""
