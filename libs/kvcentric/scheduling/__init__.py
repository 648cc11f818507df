"""Scheduling cores: the instance registry fed by load reports and the placement policies. Pure."""
