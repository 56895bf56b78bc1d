"""The process runtime: everything that turns one call into N ranks and back.

``launcher`` (``labkit.launch``'s engine: the rendezvous, relaying output, errors, timeouts,
restarts, torchrun), ``rankserver`` (imports torch once, forks a rank per request),
``worker`` (a rank's own side: process group, output, results, stack dumps) and
``deadlock`` (who waits for whom). It imports nothing from the exercises or the course
machinery; they import it.
"""
