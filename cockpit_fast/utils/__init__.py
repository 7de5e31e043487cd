"""Schedules and preset configurations for :class:`cockpit_fast.cockpit.Cockpit`."""
