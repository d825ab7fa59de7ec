"""Entry points that set up, train and save a model (as torchtune lays out recipes): each a small
CLI over the training library in ``components.training``, beside its YAML in ``configs/train/``."""
