"""The page: a plan (and, under ``edge serve``, its live memory) as one self-contained HTML document.

:func:`plan_page` is what ``edge plan --html`` writes; :func:`live_page` what
``edge serve`` answers at :data:`PAGE_PATH`. Both draw the plan with the one
:func:`plan_section`. Import-cheap: the standard library only.
"""

from .render import PAGE_PATH, live_page, plan_page, plan_section

__all__ = ["PAGE_PATH", "live_page", "plan_page", "plan_section"]
