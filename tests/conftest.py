"""Test-session settings: tests use small tensors, where one intra-op thread is fastest and
immune to oversubscription on the 2-core CI machine."""
import torch

torch.set_num_threads(1)
