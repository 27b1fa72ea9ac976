"""Run-time stand-ins for tests/test_detect_s51_optim51.py: modules whose class names are the reproducer's."""

from torch import nn


class RoutedFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class SubRouted(RoutedFFN):
    pass


class DenseStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


class MoEStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.ffn = nn.Linear(4, 4), RoutedFFN()


class SubMoEStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = SubRouted()
