"""The evaluation as a package: what the scripts in ``scripts/`` share.

Every module has one job; the scripts are thin command lines over them:

- :mod:`kvtransport.eval.statistics`: means with 95 % t-intervals, paired differences,
  table cells, the benchmarks' best of N;
- :mod:`kvtransport.eval.provenance`: the machine a figure was made on (CPU, cores, load);
- :mod:`kvtransport.eval.figures`: Markdown tables, matplotlib (Agg) and the provenance
  caption under a figure;
- :mod:`kvtransport.eval.registries`: the names an evaluation compares (repair schemes and
  their labels, the product's pick, link-sharing allocators) and how each is built;
- :mod:`kvtransport.eval.args`: command-line value parsers the scripts share;
- :mod:`kvtransport.eval.cells`: held-out episodes of one channel and rho, every scheme;
- :mod:`kvtransport.eval.multiuser`: link-sharing scenarios and every allocator on one;
- :mod:`kvtransport.eval.handoffs`: real-model handoffs (a prefilled prompt, its stream
  through the simulator, the rebuilt cache's answer);
- :mod:`kvtransport.eval.harness`: one ``scripts/evaluate.py`` run (settings, outputs,
  memoized handoffs) and :mod:`kvtransport.eval.figures_transport` /
  :mod:`kvtransport.eval.figures_model`, its figures.

It sits above the model, agents and demo layers it drives (docs/architecture.md) and needs
the ``eval`` extra (scipy, matplotlib, tqdm, worlddatax) where a function says so.
"""
