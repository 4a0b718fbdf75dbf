"""Stands in for a library's private serving loop (transformers' continuous_api, vLLM's engine)
that ``--entry`` names: in a newer version it takes a new keyword (as transformers 5.24's
``_generation_loop_body`` took ``use_inference_mode=``), and ``Missing`` is a name it lost."""
import torch


class Engine:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 4)

    def _loop_body(self, x: torch.Tensor, *, use_inference_mode: bool = False) -> float:
        with torch.inference_mode(use_inference_mode):
            return float(self.model(x).sum().detach())
