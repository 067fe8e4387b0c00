"""``python -m chameleon_elastic.launcher``: ``chameleon-run``, as ``python -m
torch.distributed.run`` is torchrun (for environments where console scripts are not on PATH)."""

from .cli import command

if __name__ == "__main__":
    command()
