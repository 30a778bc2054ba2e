"""`asyncrl plan`: predict a run's throughput, staleness and idle time before paying for GPUs.

Job: a discrete-event simulator of the pipeline (`sim.py`) that drives the real admission rule
(`asyncrl.staleness.StalenessManager` with `asyncrl.admission.Pace`) from a simulated clock, fed
with component costs (`costs.py`: from `asyncrl bench`'s cost-model load or from a YAML profile of a
public GPU configuration in `profiles/`); a search of the rollout:trainer split for a GPU budget
(`search.py`); validation of the predictions against measured runs (`validate.py`); the command
line (`command.py`). It never starts servers, a trainer or Ray.
"""
