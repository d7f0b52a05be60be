"""Recurrent layers under the offloader: loss, every weight gradient and the input gradient
bit-identical to a run without it.

Ported in spirit from PyTorch's ``test/test_nn.py`` RNN tests (``test_RNN_cpu_vs_cudnn*``,
``test_pack_sequence_batch_sizes``, ``test_rnn_args_check``) and ``test/test_autograd.py``
(``test_LSTM_grad_and_gradgrad``, ``test_lstmcell_backward_only_one_output_grad``): the same
modules and input layouts, checked for exactness instead of against cuDNN or gradcheck.
"""
from __future__ import annotations

import pytest
import torch
from helpers.exact import loss_step
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

IN, HID, BATCH, T = 8, 12, 4, 7
LENGTHS = torch.tensor([7, 3, 5, 1])  # unsorted on purpose (enforce_sorted=False)


class Seq(nn.Module):
    """``rnn`` over a padded batch (optionally packed), then a linear head on every time step."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x: torch.Tensor, packed: bool, h0: object = None) -> torch.Tensor:
        if packed:
            seq = pack_padded_sequence(x, LENGTHS, batch_first=True, enforce_sorted=False)
            out, _ = self.rnn(seq, h0)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        else:
            out, _ = self.rnn(x, h0)
        mask = (torch.arange(T)[None, :] < LENGTHS[:, None]).unsqueeze(-1)
        return (self.head(out) * mask).pow(2).sum() / mask.sum()


RNNS = {
    "lstm": lambda: nn.LSTM(IN, HID, num_layers=2, batch_first=True, bidirectional=True, dropout=0.25),
    "gru": lambda: nn.GRU(IN, HID, num_layers=2, batch_first=True, bidirectional=True, dropout=0.25),
    "rnn_tanh": lambda: nn.RNN(IN, HID, num_layers=2, batch_first=True),
    "rnn_relu_bidir": lambda: nn.RNN(IN, HID, num_layers=1, batch_first=True, nonlinearity="relu", bidirectional=True),
}


def _padded_input() -> torch.Tensor:
    x = torch.randn(BATCH, T, IN)
    x[torch.arange(T)[None, :] >= LENGTHS[:, None]] = 0.0  # padding
    return x.requires_grad_()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", sorted(RNNS))
def test_rnn_modules(kind: str, packed: bool, exact) -> None:
    """nn.LSTM / nn.GRU (batch_first, 2 layers, bidirectional, inter-layer dropout) and nn.RNN,
    on a zero-padded batch and on the same batch through ``pack_padded_sequence``."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Seq(RNNS[kind]())

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = _padded_input()
        return model(x, packed), {"x": x}

    exact(build, loss_step(forward))


def test_lstm_with_initial_state(exact) -> None:
    """nn.LSTM with a learnable-looking initial (h0, c0) that requires grad: its gradients match too."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Seq(nn.LSTM(IN, HID, num_layers=2, batch_first=True, bidirectional=True))

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = _padded_input()
        h0 = torch.randn(4, BATCH, HID, requires_grad=True)
        c0 = torch.randn(4, BATCH, HID, requires_grad=True)
        return model(x, True, (h0, c0)), {"x": x, "h0": h0, "c0": c0}

    exact(build, loss_step(forward))


class Cells(nn.Module):
    """Two stacked cells unrolled over time by hand (a ModuleList: the cells are the layers)."""

    def __init__(self, cell: type[nn.RNNCellBase]) -> None:
        super().__init__()
        self.lstm = cell is nn.LSTMCell
        self.cells = nn.ModuleList([cell(IN, HID), cell(HID, HID)])
        self.head = nn.Linear(HID, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states: list[object] = [None, None]
        outs = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for k, cell in enumerate(self.cells):
                states[k] = cell(inp, states[k])
                inp = states[k][0] if self.lstm else states[k]
            outs.append(self.head(inp))
        return torch.stack(outs, 1).pow(2).mean()


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.RNNCell], ids=lambda c: c.__name__)
def test_rnn_cells(cell: type[nn.RNNCellBase], exact) -> None:
    """nn.LSTMCell / nn.GRUCell / nn.RNNCell stepped over time: every step saves its own gates."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Cells(cell)

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(BATCH, 5, IN, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward))
