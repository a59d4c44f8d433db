"""Token embedding whose weights always come from a checkpoint."""

from torch import nn


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        # No random init: every weight is loaded (load_weights checks), and init on the meta
        # device pulls in torch's compiler stack, a second of every cold start.
        pass
