"""Workers: tensors, the paged KV cache, the model forward and sampling."""
