"""Any ``nn.Module`` as a causal language model on the generic engines: ``recipes.lm.train.main``."""
