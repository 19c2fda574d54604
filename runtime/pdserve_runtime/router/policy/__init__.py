"""Routing policies as small plugins: filters narrow the candidates, scorers rate them in [0, 1], a picker
chooses. `base.Profile` composes them; `scheduler.Scheduler` builds the decode and prefill profiles from the
typed `RoutingPolicyConfig` by plain construction (no registry, no string-keyed factory), so the composition is
visible in one place and checked by mypy.
"""
