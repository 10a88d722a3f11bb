"""Slurm clusters as regions: the region's configuration (``config``) and the connector that drives
Slurm through its own command-line tools (``cli``). Plain Python: the services that use them are
``nodes.services.slurm`` (inventory, accounts) and ``scheduling.services.slurm`` (jobs)."""
