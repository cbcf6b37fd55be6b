"""Putting compiled graphs back into the live PyTorch model: the splice, its traffic meter, its memo
of repeated calls, spliced weights paged out."""
