"""What the bench scripts share, one concern a module.

* :mod:`lib.machine`: the machine, revision and load every result names;
* :mod:`lib.results`: result files (CSV, JSON, PNG) and the lines that say where they went;
* :mod:`lib.plots`: a matplotlib figure written to a file;
* :mod:`lib.progress`: a progress bar that survives a rank's captured output;
* :mod:`lib.options`: the options every script takes (ranks, output folder, progress);
* :mod:`lib.specs`: a run's spec, a compressor spec with the DDP hook's options;
* :mod:`lib.spawning`: spawned Gloo ranks with their logs, or torchrun's;
* :mod:`lib.link`: ``--bandwidth``, a ``tc``-limited loopback in a namespace of its own;
* :mod:`lib.cluster`: ``--nodes``, an emulated cluster of network namespaces;
* :mod:`lib.ddp_training`, :mod:`lib.ddp_schedule`, :mod:`lib.ddp_report`,
  :mod:`lib.ddp_sweep`: ``ddp_train.py``'s runs, their schedule on the ranks, their
  table and predictions, and the sweep over links;
* :mod:`lib.convergence_lm`, :mod:`lib.lm`: ``convergence.py --task lm`` and its model.
* :mod:`lib.torchft_diloco`, :mod:`lib.torchft_runs`: ``torchft_train.py``'s DiLoCo loop and its
  replica groups (their process, and the driver with its lighthouse).
"""
