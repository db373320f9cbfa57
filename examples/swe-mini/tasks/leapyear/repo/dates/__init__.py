from dates.leap import days_in_month, is_leap
